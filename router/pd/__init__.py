"""Prefill/decode disaggregation on the wire: one request, two engines, two protocols."""
