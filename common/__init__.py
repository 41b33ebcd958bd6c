"""What every warmgate process uses (the supervisor, the cache process, engine workers)."""
