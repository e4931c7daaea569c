"""Small models sgl_kara makes itself: random-weight fixtures and the embedded default."""
