"""Developer tools that check rather than measure (not installed with dilax)."""
