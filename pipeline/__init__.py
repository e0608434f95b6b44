"""PySpark pipeline over mqstore segment files.

- `pipeline.parsers`  pure segment parsers (no Spark): commitlog and DLedger segments
- `pipeline.source`   the `mqstore` Spark data source (`MqstoreDataSource`)
- `pipeline.jobs`     rebuild, audit, export, stats
- `pipeline.cli`      `python -m pipeline <job>`

Importing the package does not import Spark.
"""

__all__ = ["parsers", "source", "jobs", "cli"]
