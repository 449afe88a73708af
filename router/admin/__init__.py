"""The admin API under ``/admin/``, behind its bearer token: workers, index, explain."""
