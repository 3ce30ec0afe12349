"""Hugging Face formats at the edges: `export` writes a checkpoint as a Llama/Mixtral folder that
transformers' Auto classes load (trainers/hf/export.py); `model.init_from` starts a run from such a folder
(trainers/hf/pretrained.py); trainers/sections/hf_config.py reads config.json into the `model` section and
trainers/hf/format.py writes it and maps tensor names both ways. Only safetensors and JSON cross the edge:
nothing from outside a run is read with pickle."""
