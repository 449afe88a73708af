"""Operating it: metrics, tracing, the hit audit, the capacity forecast, doctor, rate logs."""
