"""The simulated cluster: nodes (namespaces + sshd + systemd) and simulated engines."""
