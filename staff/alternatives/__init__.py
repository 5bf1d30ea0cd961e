"""Staff alternative implementations of Tasks 3, 4 and 6 (README.md); grading.py grades them."""
