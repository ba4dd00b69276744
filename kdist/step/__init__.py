"""One training step's math for every engine: the compiled model's step
(`compiled`) and what the engines ask of its optimizer (`optimizer`)."""
