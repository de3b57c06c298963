"""The sources (``pspf.source``) and the admin API's ingest route against a real server."""
