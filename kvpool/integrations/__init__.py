"""Adapters that put kvpool inside other serving engines; each needs its engine installed (an optional extra)."""
