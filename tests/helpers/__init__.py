"""Test helpers that the job imports by name (``model.name: tests.helpers.models:hang``)."""
