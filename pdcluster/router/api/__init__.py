"""The router's HTTP edge and OpenAI protocol: the aiohttp app (`server`), its handlers, request
parsing and the parameter policy (`protocol`, `params`, `guided`, `messages`, `tools`),
tokenization and chat templates, and the response shapes. It asks `router.routing` where a request
goes and never imports `router.sim`."""
