package onceflow.spark;

import java.io.IOException;
import java.lang.invoke.MethodHandles;
import java.lang.invoke.VarHandle;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonToken;
import com.fasterxml.jackson.core.StreamReadConstraints;
import com.fasterxml.jackson.core.util.BufferRecycler;
import com.fasterxml.jackson.core.util.RecyclerPool;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow;
import org.apache.spark.unsafe.types.UTF8String;

/**
 * One JSON line decoded against declared columns by the rules of
 * onceflow.sources.json_records (its module docstring states them; reference_decode states
 * them in Python, and the tests hold this decoder equal to the Python one): one JSON object
 * (RFC 8259, UTF-8, no byte-order mark, no NaN, no lone surrogate escape), each declared
 * column from the last field of its name, typed exactly; otherwise the line is corrupt
 * (every column null, {@code _corrupt_record} the line). {@code _problem}: over
 * max_record_bytes (not decoded), or a NUL byte.
 */
final class LineDecoder {
  private static final String NUL = "payload holds a NUL character, which PostgreSQL text "
      + "cannot store";
  private static final VarHandle LONGS =
      MethodHandles.byteArrayViewVarHandle(long[].class, ByteOrder.LITTLE_ENDIAN);
  private static final long ONES = 0x0101010101010101L;
  private static final long HIGHS = 0x8080808080808080L;
  private static final long BACKSLASHES = 0x5C5C5C5C5C5C5C5CL;

  /**
   * Jackson's buffers for this decoder's parsers, one parser at a time: Jackson's default pool
   * finds them through a ThreadLocal lookup per parser, and a decoder makes a parser per line.
   */
  private static final class OwnBuffers implements RecyclerPool<BufferRecycler> {
    private static final long serialVersionUID = 1L;
    private final transient BufferRecycler buffers = new BufferRecycler();

    @Override
    public BufferRecycler acquirePooled() {
      return buffers;
    }

    @Override
    public void releasePooled(BufferRecycler pooled) {
    }
  }

  private final JsonFactory json = JsonFactory.builder()
      // the rules bound a line by max_record_bytes only (the nesting depth keeps Jackson's
      // limit, about a thousand levels, as the Python decoder's)
      .streamReadConstraints(StreamReadConstraints.builder()
          .maxNumberLength(Integer.MAX_VALUE)
          .maxStringLength(Integer.MAX_VALUE)
          .maxNameLength(Integer.MAX_VALUE)
          .build())
      .recyclerPool(new OwnBuffers())
      .build();
  private static final int STRING = 0, BOOLEAN = 1, TINYINT = 2, SMALLINT = 3, INT = 4,
      BIGINT = 5, FLOAT = 6, DOUBLE = 7;

  private final int[] kinds;
  private final String[] names;
  private final long maxBytes;
  private final Object[] values;
  private final boolean[] wrong;

  LineDecoder(String[][] columns, long maxBytes) {
    kinds = new int[columns.length];
    names = new String[columns.length];
    for (int i = 0; i < columns.length; i++) {
      names[i] = columns[i][0].intern();
      kinds[i] = Arrays.asList("string", "boolean", "tinyint", "smallint", "int", "bigint",
          "float", "double").indexOf(columns[i][1]);
    }
    this.maxBytes = maxBytes;
    values = new Object[columns.length];
    wrong = new boolean[columns.length];
  }

  /** The row of line {@code data[start, end)}: partition, offset, columns, corrupt, problem. */
  InternalRow row(byte[] data, int start, int end, int partition, long offset) {
    int n = kinds.length;
    Object[] out = new Object[n + 4];
    out[0] = partition;
    out[1] = offset;
    int length = end - start;
    if (maxBytes >= 0 && length > maxBytes) {
      out[n + 3] = UTF8String.fromString("oversized record (" + length
          + " bytes, over max_record_bytes=" + maxBytes + ")");
    } else if (decode(data, start, end)) {
      System.arraycopy(values, 0, out, 2, n);
    } else if (contains(data, start, end, (byte) 0)) {
      out[n + 3] = UTF8String.fromString(NUL);
    } else {
      out[n + 2] = UTF8String.fromString(replacing(data, start, end));
    }
    return new GenericInternalRow(out);
  }

  private boolean decode(byte[] data, int start, int end) {
    Arrays.fill(values, null);
    Arrays.fill(wrong, false);
    // Before Jackson: a NUL among the first four bytes would make it read the line as
    // UTF-16 or UTF-32 (a NUL anywhere else fails the parse: a line holding one is never JSON);
    // a line that is not all ASCII must be valid UTF-8 (Jackson does not check all of it)
    // and must not start with a byte-order mark (Jackson skips one); and a backslash-u escape
    // of a surrogate (\\uD800-\\uDFFF) makes every string be checked for a lone one.
    for (int i = start; i < Math.min(end, start + 4); i++) {
      if (data[i] == 0) {
        return false;
      }
    }
    long high = 0;
    boolean backslash = false;
    int at = start;
    for (; at + 8 <= end; at += 8) {  // eight bytes at a time
      long word = (long) LONGS.get(data, at);
      high |= word;
      long x = word ^ BACKSLASHES;  // a zero byte where a backslash was
      backslash |= ((x - ONES) & ~x & HIGHS) != 0;
    }
    for (; at < end; at++) {
      high |= data[at];
      backslash |= data[at] == '\\';
    }
    boolean ascii = (high & HIGHS) == 0;
    boolean surrogates = backslash && mayHaveSurrogateEscape(data, start, end);
    if (!ascii) {
      if (end - start >= 3 && data[start] == (byte) 0xEF && data[start + 1] == (byte) 0xBB
          && data[start + 2] == (byte) 0xBF) {
        return false;  // a byte-order mark
      }
      if (!validUtf8(data, start, end)) {
        return false;
      }
    }
    try (JsonParser p = json.createParser(data, start, end - start)) {
      if (p.nextToken() != JsonToken.START_OBJECT) {
        return false;
      }
      JsonToken t;
      while ((t = p.nextToken()) == JsonToken.FIELD_NAME) {
        String name = p.currentName();
        if (surrogates && loneSurrogate(name)) {
          return false;
        }
        t = p.nextToken();
        int i = indexOf(name);
        if (i < 0) {
          if (!skip(p, t, surrogates)) {
            return false;
          }
          continue;
        }
        values[i] = null;
        wrong[i] = false;
        if (t == JsonToken.VALUE_NULL) {
          continue;
        }
        if (t == JsonToken.VALUE_STRING && surrogates && loneSurrogate(p.getText())) {
          return false;
        }
        Object value = value(p, t, kinds[i]);
        if (value == null) {
          wrong[i] = true;
          if (!skip(p, t, surrogates)) {
            return false;
          }
        }
        values[i] = value;
      }
      if (t != JsonToken.END_OBJECT || p.nextToken() != null) {
        return false;  // (what follows the object, if anything, is not whitespace)
      }
    } catch (IOException e) {  // not JSON (JsonProcessingException), or too deep
      return false;
    }
    for (boolean w : wrong) {
      if (w) {
        return false;
      }
    }
    return true;
  }

  /** The index of the declared column named {@code name}, or -1. */
  private int indexOf(String name) {
    for (int i = names.length - 1; i >= 0; i--) {
      if (names[i].equals(name)) {  // (an identity check first: Jackson interns names)
        return i;
      }
    }
    return -1;
  }

  /** The current string token as Spark's UTF-8 text, without a Java String when it is ASCII. */
  private static UTF8String text(JsonParser p) throws IOException {
    char[] chars = p.getTextCharacters();
    int offset = p.getTextOffset();
    int length = p.getTextLength();
    byte[] bytes = new byte[length];
    for (int k = 0; k < length; k++) {
      char c = chars[offset + k];
      if (c >= 0x80) {
        return UTF8String.fromString(p.getText());
      }
      bytes[k] = (byte) c;
    }
    return UTF8String.fromBytes(bytes);
  }

  /** The value of the current token as a column of {@code kind}, or null if it is not one. */
  private static Object value(JsonParser p, JsonToken t, int kind) throws IOException {
    switch (kind) {
      case STRING:
        return t == JsonToken.VALUE_STRING ? text(p) : null;
      case BOOLEAN:
        return t == JsonToken.VALUE_TRUE ? Boolean.TRUE
            : t == JsonToken.VALUE_FALSE ? Boolean.FALSE : null;
      case TINYINT:
      case SMALLINT:
      case INT:
        if (t != JsonToken.VALUE_NUMBER_INT || p.getNumberType() != JsonParser.NumberType.INT) {
          return null;
        }
        int v = p.getIntValue();
        if (kind == TINYINT) {
          return v >= Byte.MIN_VALUE && v <= Byte.MAX_VALUE ? (Object) (byte) v : null;
        }
        if (kind == SMALLINT) {
          return v >= Short.MIN_VALUE && v <= Short.MAX_VALUE ? (Object) (short) v : null;
        }
        return v;
      case BIGINT:
        if (t != JsonToken.VALUE_NUMBER_INT
            || p.getNumberType() == JsonParser.NumberType.BIG_INTEGER) {
          return null;
        }
        return p.getLongValue();
      default: {  // FLOAT, DOUBLE: any number within a double's range
        if (t != JsonToken.VALUE_NUMBER_INT && t != JsonToken.VALUE_NUMBER_FLOAT) {
          return null;
        }
        double d;  // (an integer rounds to the nearest double, as Python's float(int))
        if (t == JsonToken.VALUE_NUMBER_FLOAT) {
          d = p.getDoubleValue();
        } else if (p.getNumberType() == JsonParser.NumberType.BIG_INTEGER) {
          d = p.getBigIntegerValue().doubleValue();
        } else {
          d = (double) p.getLongValue();
        }
        if (Double.isInfinite(d) || Double.isNaN(d)) {
          return null;
        }
        return kind == FLOAT ? (Object) (float) d : (Object) d;
      }
    }
  }

  /** Past the current value (checked as JSON); false if it holds a lone surrogate. */
  private static boolean skip(JsonParser p, JsonToken t, boolean surrogates) throws IOException {
    if (!surrogates) {
      if (t == JsonToken.START_OBJECT || t == JsonToken.START_ARRAY) {
        p.skipChildren();
      }
      return true;
    }
    int depth = 0;
    while (true) {
      if (t == JsonToken.START_OBJECT || t == JsonToken.START_ARRAY) {
        depth++;
      } else if (t == JsonToken.END_OBJECT || t == JsonToken.END_ARRAY) {
        depth--;
      } else if ((t == JsonToken.VALUE_STRING || t == JsonToken.FIELD_NAME)
          && loneSurrogate(p.getText())) {
        return false;
      }
      if (depth == 0) {
        return true;
      }
      t = p.nextToken();
      if (t == null) {
        return true;  // (the parser reports the unfinished document)
      }
    }
  }

  private static boolean mayHaveSurrogateEscape(byte[] data, int start, int end) {
    for (int i = start; i + 3 < end; i++) {
      if (data[i] == '\\' && data[i + 1] == 'u' && (data[i + 2] | 0x20) == 'd') {
        int c = data[i + 3] | 0x20;
        if (c == '8' || c == '9' || (c >= 'a' && c <= 'f')) {
          return true;
        }
      }
    }
    return false;
  }

  private static boolean loneSurrogate(String s) {
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      if (Character.isHighSurrogate(c)) {
        if (i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1))) {
          i++;
        } else {
          return true;
        }
      } else if (Character.isLowSurrogate(c)) {
        return true;
      }
    }
    return false;
  }

  private static boolean contains(byte[] data, int start, int end, byte b) {
    for (int i = start; i < end; i++) {
      if (data[i] == b) {
        return true;
      }
    }
    return false;
  }

  /**
   * The UTF-8 sequence at {@code data[i]} (i below end): its length when it is well-formed
   * (Unicode's table of well-formed byte sequences: no overlong forms, no surrogates, nothing
   * past U+10FFFF), else minus the length of its maximal ill-formed part (at least 1).
   */
  private static int sequence(byte[] data, int i, int end) {
    int b = data[i] & 0xFF;
    if (b < 0x80) {
      return 1;
    }
    if (b < 0xC2 || b > 0xF4) {  // a continuation byte, or a byte that never starts one
      return -1;
    }
    int need = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1;
    int lo = b == 0xE0 ? 0xA0 : b == 0xF0 ? 0x90 : 0x80;  // the second byte's range
    int hi = b == 0xED ? 0x9F : b == 0xF4 ? 0x8F : 0xBF;
    for (int k = 1; k <= need; k++) {
      int c = i + k < end ? data[i + k] & 0xFF : -1;
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) {
        return -k;
      }
    }
    return need + 1;
  }

  /**
   * {@code data[start, end)} as text, each maximal part of an ill-formed UTF-8 sequence
   * replaced by one U+FFFD (Unicode's recommended practice, which Python's
   * {@code decode("utf-8", "replace")} follows; Java's decoder replaces differently, e.g. an
   * encoded surrogate as one character instead of three).
   */
  static String replacing(byte[] data, int start, int end) {
    StringBuilder out = new StringBuilder(end - start);
    for (int i = start; i < end; ) {
      int n = sequence(data, i, end);
      if (n == 1) {
        out.append((char) data[i]);
      } else if (n > 0) {
        out.append(new String(data, i, n, StandardCharsets.UTF_8));
      } else {
        out.append('\uFFFD');
        n = -n;
      }
      i += n;
    }
    return out.toString();
  }

  /** Whether {@code data[start, end)} is well-formed UTF-8. */
  static boolean validUtf8(byte[] data, int start, int end) {
    for (int i = start; i < end; ) {
      int n = sequence(data, i, end);
      if (n < 0) {
        return false;
      }
      i += n;
    }
    return true;
  }
}
