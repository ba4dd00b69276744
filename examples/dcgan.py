"""DCGAN: two models, two optimizers, alternating updates; one step for every backend.

    KERAS_BACKEND=jax python examples/dcgan.py --synthetic 1200 --epochs 1 --replicas 2
    python examples/dcgan.py --epochs 10 --replicas 2 --grid dcgan.png   # Fashion-MNIST

It takes kdist-train's flags (`--help`). After training it restores the
newest checkpoint and, with `--grid`, saves generated images as a PNG grid
(needs matplotlib). Keras' "Customizing what happens in fit()" writes this
step once per backend; here it is written once.
"""

import argparse
import sys

import keras
from keras import layers, ops

import kdist
from kdist.cli import train

LATENT = 64


class GAN(keras.Model):
    def __init__(self, learning_rate=2e-4):
        super().__init__()
        self.discriminator = keras.Sequential([
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2D(64, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.GlobalMaxPooling2D(), layers.Dense(1)], name="discriminator")
        self.generator = keras.Sequential([
            keras.Input((LATENT,)),
            layers.Dense(7 * 7 * 64), layers.LeakyReLU(0.2), layers.Reshape((7, 7, 64)),
            layers.Conv2DTranspose(64, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2DTranspose(32, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2D(1, 5, padding="same", activation="sigmoid")], name="generator")
        self.d_optimizer = keras.optimizers.Adam(learning_rate, beta_1=0.5)
        self.g_optimizer = keras.optimizers.Adam(learning_rate, beta_1=0.5)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def d_loss(self, real, fake):
        """The discriminator's loss: fake images are labelled 1, real ones 0."""
        rows = ops.shape(real)[0]
        labels = ops.concatenate([ops.ones((rows, 1)), ops.zeros((rows, 1))])
        return self.bce(labels, self.discriminator(ops.concatenate([fake, real])))

    def g_loss(self, fake):
        """The generator's loss: its images called real (0) by the discriminator."""
        return self.bce(ops.zeros((ops.shape(fake)[0], 1)), self.discriminator(fake))

    def train_step(self, data):
        real, _ = data
        rows = ops.shape(real)[0]
        d, g = self.discriminator.trainable_variables, self.generator.trainable_variables
        fake = self.generator(kdist.random.normal((rows, LATENT)))
        d_loss, grads = kdist.value_and_grad(lambda: self.d_loss(real, fake), d)
        self.d_optimizer.apply(grads, d)
        z = kdist.random.normal((rows, LATENT))
        g_loss, grads = kdist.value_and_grad(lambda: self.g_loss(self.generator(z)), g)
        self.g_optimizer.apply(grads, g)
        return {"d_loss": d_loss, "g_loss": g_loss}

    def test_step(self, data):
        real = data[0]
        fake = self.generator(kdist.random.normal((ops.shape(real)[0], LATENT)))
        return {"d_loss": self.d_loss(real, fake), "g_loss": self.g_loss(fake)}


def model(args=None):
    """The GAN, with `--learning-rate` if given (default 2e-4)."""
    return GAN(getattr(args, "learning_rate", None) or 2e-4)


def save_grid(model, path, rows=4, seed=0):
    """Saves rows x rows generated images as a PNG."""
    from matplotlib import pyplot as plt

    z = keras.random.normal((rows * rows, LATENT), seed=seed)
    images = ops.convert_to_numpy(model.generator(z, training=False))[..., 0]
    figure, axes = plt.subplots(rows, rows, figsize=(rows, rows))
    for image, axis in zip(images, axes.flat):
        axis.imshow(image, cmap="gray")
        axis.axis("off")
    figure.savefig(path, dpi=100)
    print(f"Saved {rows * rows} generated images to {path}")


def main(argv=None):
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--grid", metavar="PNG", help="save generated images there")

    def after(args):
        if args.grid:
            model = GAN()
            model.d_optimizer.build(model.discriminator.trainable_variables)
            model.g_optimizer.build(model.generator.trainable_variables)
            model.built = True
            model.load_weights(kdist.latest_checkpoint(args.checkpoint_dir))
            save_grid(model, args.grid)

    return train.main(argv, model_fn=model, description=__doc__, after=after, flags=extra)


if __name__ == "__main__":
    sys.exit(main())
