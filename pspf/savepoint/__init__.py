"""Savepoints: an app's whole state and positions at one cut, written to a directory, and restored.

- ``manifest``: the savepoint on disk (one state file per partition, ``manifest.json`` last), local
  or in an object store;
- ``taking``: the cut, read from the state backups while the app runs or stopped, and the server's
  list of an app's savepoints;
- ``restoring``: an app, or a fork under a new name, put at a savepoint's cut: staged, then
  switched in, resumable; split or merged by key after a repartition.

The operations the CLI and the admin API offer are ``pspf.service.savepoints``.
"""
