"""The process backend (the embedded default): a working directory and, as root, a user
id per trajectory; commands started cheaply off the event loop and cleaned up after."""
