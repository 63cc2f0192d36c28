"""The package's version: what the rank's registration, trace metadata, the daemon's status and both commands'
--version report. Here, in core/, so that rank/ and host/ read it without importing the package root (which
imports the rank's hook)."""

__version__ = "0.1.0"
