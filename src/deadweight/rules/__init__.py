"""Rules judge: each module declares one family of rules with `@rule`.

Every module in this package is imported by the registry, so a new rule file is
picked up without edits elsewhere.
"""
