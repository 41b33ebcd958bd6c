"""warmgate supervisor: HTTP gateway, engine manager, admin, metrics and the CLI."""
