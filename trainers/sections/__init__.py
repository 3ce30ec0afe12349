"""Each component's section of the run YAML (`trainers.config.RunConfig` holds them), and what a section needs
to validate itself (`hf_config`). A low layer: these import only `trainers._base` and `trainers.storage`."""
