"""`tangram serve`'s HTTP side: the app, its routes, the service they call, the journal,
request limits and the status page."""
