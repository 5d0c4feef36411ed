"""The pipeline, above the models, exporters, engines and validation: what ``kkdeploy build``,
``bench`` and ``kkdeploy.load`` do with them.

``build`` (export -> candidates -> validate -> time -> choose -> write artifacts), ``chooser``
(which validated candidate ships and which serves padded calls), ``runtime`` (``kkdeploy.load``),
``bench`` and ``timing`` (the organizer's timing protocol), ``long_context`` (shape 14's check and
build). Nothing below this package imports it.
"""
