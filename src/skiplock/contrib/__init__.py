"""Integrations with frameworks (Django, SQLAlchemy), each behind an extra of its own:
importing one needs its framework installed; the core never imports them."""
