"""Reservation slabs, the pool's side: the slab table's books and their endpoints."""
