"""The HTTP backend: outbound API calls under quota, to destinations on the allow-list."""
