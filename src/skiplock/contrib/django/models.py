"""No models: skiplock's tables are its own (schema.py). The module exists because Django
sends ``post_migrate`` only to apps that have one, and that signal is what keeps
skiplock's schema current (apps.py)."""
