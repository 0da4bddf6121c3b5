"""The imperative shell's reach into nodes: transports, probing, executing plans."""
