"""The torch half of the engine: model preparation, linear layers, the runner and the loader."""
