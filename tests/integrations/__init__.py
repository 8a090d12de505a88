"""Tests of the integrations: SQLAlchemy sessions, the test helpers and their pytest
plugin, and the FastAPI example, each on the real PostgreSQL of the run."""
