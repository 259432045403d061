"""The package version, in a module of its own so that code inside the package
(the server's ``/version``) can read it without importing ``pagedllm`` itself."""

__version__ = "0.1.0"
