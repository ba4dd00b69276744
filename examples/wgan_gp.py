"""WGAN-GP: a gradient penalty, the gradient of the critic with respect to its input,
inside the critic's loss; one step for every backend.

    KERAS_BACKEND=torch python examples/wgan_gp.py --synthetic 1200 --epochs 1 --replicas 2
    python examples/wgan_gp.py --epochs 10 --replicas 2       # Fashion-MNIST

It takes kdist-train's flags (`--help`). Keras' WGAN-GP example is written
for TensorFlow only, because of the nested gradient; here it is written once.
"""

import sys

import keras
from keras import layers, ops

import kdist
from kdist.cli import train

LATENT = 64


class WGANGP(keras.Model):
    def __init__(self, learning_rate=2e-4, critic_steps=3, gp_weight=10.0):
        super().__init__()
        self.critic = keras.Sequential([
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2D(64, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Flatten(), layers.Dense(1)], name="critic")
        self.generator = keras.Sequential([
            keras.Input((LATENT,)),
            layers.Dense(7 * 7 * 64), layers.LeakyReLU(0.2), layers.Reshape((7, 7, 64)),
            layers.Conv2DTranspose(32, 4, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.Conv2DTranspose(1, 4, strides=2, padding="same", activation="sigmoid")],
            name="generator")
        self.c_optimizer = keras.optimizers.Adam(learning_rate, beta_1=0.5, beta_2=0.9)
        self.g_optimizer = keras.optimizers.Adam(learning_rate, beta_1=0.5, beta_2=0.9)
        self.critic_steps, self.gp_weight = critic_steps, gp_weight

    def gradient_penalty(self, real, fake):
        """Mean of (|d critic / d x| - 1)^2 at points x between real and fake images."""
        alpha = kdist.random.uniform((ops.shape(real)[0], 1, 1, 1))
        mixed = real + alpha * (fake - real)
        grads = kdist.grad(lambda x: ops.sum(self.critic(x)), mixed)
        norms = ops.sqrt(ops.sum(ops.square(grads), axis=(1, 2, 3)) + 1e-12)
        return ops.mean(ops.square(norms - 1.0))

    def critic_loss(self, real, fake):
        wasserstein = ops.mean(self.critic(fake)) - ops.mean(self.critic(real))
        return wasserstein + self.gp_weight * self.gradient_penalty(real, fake)

    def train_step(self, data):
        real, _ = data
        rows = ops.shape(real)[0]
        c, g = self.critic.trainable_variables, self.generator.trainable_variables
        for _ in range(self.critic_steps):
            fake = self.generator(kdist.random.normal((rows, LATENT)))
            c_loss, grads = kdist.value_and_grad(lambda: self.critic_loss(real, fake), c)  # noqa: B023
            self.c_optimizer.apply(grads, c)
        z = kdist.random.normal((rows, LATENT))
        g_loss, grads = kdist.value_and_grad(lambda: -ops.mean(self.critic(self.generator(z))), g)
        self.g_optimizer.apply(grads, g)
        return {"c_loss": c_loss, "g_loss": g_loss}

    def test_step(self, data):
        real = data[0]
        fake = self.generator(kdist.random.normal((ops.shape(real)[0], LATENT)))
        return {"c_loss": self.critic_loss(real, fake), "g_loss": -ops.mean(self.critic(fake))}


def model(args=None):
    """The WGAN-GP, with `--learning-rate` if given (default 2e-4)."""
    return WGANGP(getattr(args, "learning_rate", None) or 2e-4)


if __name__ == "__main__":
    sys.exit(train.main(model_fn=model, description=__doc__))
