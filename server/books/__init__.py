"""The pool's books: pure Python, no HTTP, no torch; what every transport and tier stands on."""
