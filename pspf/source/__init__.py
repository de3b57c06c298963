"""Sources: rows from outside PSPF into a topic, each once (DESIGN "Connectors", invariant 13).

Its rooms: ``appending`` (a producer's numbered rows appended through the publishing script, which
records the producer's position on each partition in the same call, behind the layout guard),
``formats`` (reading JSON Lines, CSV and Parquet objects a row at a time) and ``files`` (the files
source, ``pspf source files``). The admin API's ingest route (``pspf.service.ingest``) appends
through ``appending`` too.
"""
