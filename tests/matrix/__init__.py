"""The differential matrix: seeded cases (model x config x path x call/change sequence), each
run against eager PyTorch on the same inputs. See tests/matrix/cases.py."""
