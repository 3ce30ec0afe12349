"""Each component's section of the run YAML (`trainers.config.RunConfig` holds them), and what a section needs
to validate itself (the model section fills itself from an init_from folder's config.json: `hf_config`). A
low layer: these import only `trainers._base` and `trainers.storage`; the components that read them are above."""
