"""The whole gateway on one machine: Envoy, BBR, one LWEPP per pool, simulated model servers."""
