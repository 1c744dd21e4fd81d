"""Every option the default run leaves off, each in a file of its own that applies itself when the
run is built: a deployment's own loop, a transform of the model, or an object passed in."""
