"""SQLAlchemy models, lifecycle states with their allowed transitions, and migrations."""
