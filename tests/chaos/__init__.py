"""The chaos suite: real worker processes killed, cut off, stopped and restarted."""
