"""Runnable reproductions of the incidents deadweight exists for; `deadweight demo` runs them."""
