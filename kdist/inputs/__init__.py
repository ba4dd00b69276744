"""Inputs of every kind, as sources with one interface (`base`): NumPy arrays
(`arrays`), tf.data and functions (`pipelines`), `keras.utils.PyDataset`
(`pydatasets`), Grain (`grainsource`) and TFRecord files (`tfrecords`);
`sources` picks the kind's source."""
