"""The commands: `kdist-train` (`train`), `kdist-evaluate` (`evaluate`),
`kdist-launch` (`launch`), `kdist-plot` (`plot`) and the data writer
(`write_data`), with what they share (`common`, `flags`). `kdist-bench` is in
`kdist.bench`."""
