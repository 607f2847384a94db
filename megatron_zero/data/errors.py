"""The one exception type for bad data input.

Its message is a single sentence naming the file (and line, where there is one)
and what is wrong, so a command-line tool can print it alone, without a traceback.
"""


class DataError(ValueError):
    """Malformed input data: a bad JSONL line, a missing key, a broken .bin/.idx pair."""
