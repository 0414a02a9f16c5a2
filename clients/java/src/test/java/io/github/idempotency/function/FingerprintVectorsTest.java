package io.github.idempotency.function;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.TestFactory;
import tools.jackson.databind.JsonNode;
import tools.jackson.databind.json.JsonMapper;

/**
 * The shared vectors of clients/testdata/function-fingerprints.json: the function's fingerprint of each
 * vector's arguments is the one every client makes of them.
 */
class FingerprintVectorsTest {
	private static final JsonMapper MAPPER = JsonMapper.builder().build();

	@TestFactory
	List<DynamicTest> theFingerprintEveryClientMakes() throws Exception {
		JsonNode file = MAPPER.readTree(Files.readString(Path.of("../testdata/function-fingerprints.json")));
		List<DynamicTest> tests = new ArrayList<>();
		for (JsonNode vector : file.get("vectors")) {
			tests.add(DynamicTest.dynamicTest(vector.get("name").asString(), () -> {
				List<Object> args = MAPPER.readValue(vector.get("arguments").asString(),
						MAPPER.getTypeFactory().constructCollectionType(List.class, Object.class));
				assertEquals(vector.get("canonical").asString(), CanonicalJson.write(MAPPER.valueToTree(args)));
				assertEquals(vector.get("sha256").asString(), HexFormat.of().formatHex(ResultJson.fingerprint(args)));
			}));
		}
		assertFalse(tests.isEmpty());
		return tests;
	}
}
