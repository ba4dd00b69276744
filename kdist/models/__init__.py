"""The models kdist builds itself: the tutorial's CNN (`cnn`), ResNet-20
(`resnet`) and their default loss (`losses`)."""
