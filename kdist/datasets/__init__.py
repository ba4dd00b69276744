"""Data sets: Fashion-MNIST (`fashion_mnist`), generated sets (`synthetic`,
`cifar_shaped`), their sizes (`sizes`) and sets written to disk (`ondisk`)."""
