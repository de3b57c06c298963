"""Data contracts: a schema per topic, versioned in Redis, checked at every door that writes the topic.

The rooms: ``schema`` (the JSON Schema subset PSPF checks, compiled once per version to a msgspec
type, ``Checker``) and ``compat`` (whether a new version may replace the current one: backward,
forward, full or none, as a schema registry decides).
"""
