"""The package version, apart so modules can read it without importing the package."""
__version__ = "0.1.0"
