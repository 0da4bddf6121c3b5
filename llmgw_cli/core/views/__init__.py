"""What operators read about the fleet: the one Summary that ``status``, the dashboard and
the metrics share, the dashboard's inline charts, and the monitoring files (Prometheus
rules, a Grafana dashboard) over the gateway's metrics.
"""
