"""Integrations of epicute's layers into other libraries' models (:mod:`epicute.integrations.transformers`)."""
