"""Model sources: the bundled demo model, local Hugging Face folders, tiny test models."""
