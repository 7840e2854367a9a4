"""The tweets example: URL and domain counts from tweets, exactly once, as a user's package.

- pipelines.py: the declarations (registered by entry point, see pyproject.toml);
- topology.py: the Spark side (a JVM parse bolt, a Python IDNA bolt, a stateful first-seen bolt);
- data.py: the generator, the one definition of a usable tweet, the independent recount;
- demo.py: `tweets-demo`, the end-to-end demo behind `bash run.sh demo`.
"""
