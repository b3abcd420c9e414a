"""Data: the data sets dpt ships (synthetic, fake images, COCO, image folders), image decoding and
transforms, and the loaders that shard one global order over the ranks and resume at a sample.

May import: base.
"""
