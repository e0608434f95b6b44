"""Pipeline test fixtures: ONE SparkSession for the whole session (startup is ~10 s).

Spark tests carry `@pytest.mark.spark`; `-m "not spark"` runs the pure parser and job
tests alone (no JVM). The session is small on purpose: local[2], 1 GiB driver, 4 shuffle
partitions, no UI, and Python workers that run this very interpreter.
"""

import os
import sys

import pytest


@pytest.fixture(scope="session")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pipeline.jobs import get_spark
    session = get_spark("local[2]", "mqstore-pipeline-tests", {
        "spark.driver.memory": "1g",
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "2",
        "spark.ui.enabled": "false",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "4096",
    })
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
