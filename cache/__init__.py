"""warmgate cache process: checkpoint reading and validation, weight processing, arenas, server."""
