"""mqstore: what users import and run. The SDK (Producer, Consumer, Admin) lands in its own
issue; today this package holds the `mqstore` command line (`mqstore.cli`)."""

__version__ = "0.1.0"
